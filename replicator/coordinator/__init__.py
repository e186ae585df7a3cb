"""The coordinator: job topology, the pure planner over hosts' reports, its gRPC service and client."""

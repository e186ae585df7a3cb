"""The peer tier: the wire protocol's shared parts, the serving side and the fetching client."""

"""Development and demo tooling: replicators as local processes (LocalCluster) and `mtc demo`. Not product API."""

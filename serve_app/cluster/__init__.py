"""Several replicas and nodes: prefix-aware routing, the local cluster."""

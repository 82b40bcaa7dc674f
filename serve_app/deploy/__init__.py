"""Ray Serve deployments: the builder, the ingress, the model replicas, the model pool."""

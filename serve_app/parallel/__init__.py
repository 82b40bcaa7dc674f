"""One model over several ranks (Macs) with ``mlx.distributed``: what a model supports,
the ranks' group, and the engine commands rank 0 shares with the others."""

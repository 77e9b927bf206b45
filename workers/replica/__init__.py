"""The history replica service: the bus consumed into a node's history store."""

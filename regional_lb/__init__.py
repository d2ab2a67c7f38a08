"""Regional tier of GTM: a cost-aware least-outstanding-work balancer for inference instances."""

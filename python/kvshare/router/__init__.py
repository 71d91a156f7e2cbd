"""`kvshare route`: a prefix-aware reverse proxy in front of kvshare replicas."""

"""The KVPolicy API (v1alpha1)."""

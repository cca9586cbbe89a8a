"""The HTTP lease broker: Raft-replicated leases over per-bucket indexes of Delta buffers."""

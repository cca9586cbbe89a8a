"""The replicated state: the Raft node and the state machine it applies (leases,
consumers and their buckets, schedules)."""

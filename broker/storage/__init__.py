"""What a node keeps of the tables and on its own disk: the index of pending messages
(rows, ids, heads), the ledger it checkpoints into, and listings."""

"""`make demo`: worker processes contend for one lease; the holder is killed; another takes over."""

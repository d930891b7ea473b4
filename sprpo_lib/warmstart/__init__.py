"""The warm start: expert demonstrations, behaviour cloning with DAgger, its cache, and its
held-out evaluation."""

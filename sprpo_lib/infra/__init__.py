"""Plumbing every layer uses: files written whole and read back checked, where things live,
registries, progress, machine facts, provenance, where work runs, where metrics go, the value
ranges of config options."""

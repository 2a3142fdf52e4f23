"""One module per strategy, each readable top to bottom; `registry.py` lists them all, and
`base.py` holds the interface they share and `make_strategy`."""

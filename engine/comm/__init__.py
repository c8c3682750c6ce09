"""How gradients cross ranks: the collectives the engine issues (collectives), the driver of a compressor's
exchange (exchange), the communicator core every comm mode is built on (core), and the modes: sync and
wfbp (wfbp), dear (dear), and torch DDP's comm hook (hooks)."""

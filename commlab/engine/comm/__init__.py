"""How gradients cross ranks: the collectives the engine issues (collectives), the driver of a compressor's
exchange, whole or sharded (exchange), the communicator core every comm mode is built on (core), the modes:
sync and wfbp (wfbp), dear (dear), all built alike and made by name (modes), and torch DDP's comm hook
(hooks)."""

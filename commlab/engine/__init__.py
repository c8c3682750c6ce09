"""What runs inside each rank (a torchrun worker), with torch and nothing of commlab/lab/, commlab/app/ or commlab/:

- compressors/  gradient compressors: one base class, a registry, error feedback, the exchange seam
- comm/         how gradients cross ranks: collectives, the exchange driver, the communicator core, the comm
                modes (sync, wfbp, dear) and torch DDP's comm hook
- schedules     fusion schedules (pure functions from parameters to buckets); tuners/ search them online
- spec          the job spec and its checks; models, data, external (your own models and data)
- stepper, trainer, worker   one rank's training loop, its writers and its process; trials, autoprofile
                for strategy auto; probe and timeline for per-layer spans; netmodel for modeled links; cluster
                for clusters of unequal workers (each rank its own link and speed)
"""

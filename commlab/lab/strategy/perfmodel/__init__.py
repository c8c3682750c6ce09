"""Performance model: when does gradient compression pay (Agarwal et al., MLSys 2022)?

    costs       alpha-beta collectives per Link (ring formulas from commlab.engine.netmodel), padded
                all-gather, parameter server, token bucket of an emulated link
    iteration   one step of sync / wfbp / dear simulated: a compute thread and one link
    calibrate   Profile (JSON) from run timelines, comm spans, shaped-link and compressor measurements
    predict     iteration time of a spec, speedup over DDP, crossover bandwidth
    whatif      profile lookup and the table of ``commlab predict``
    views       what the UI page shows (speedup grid, crossovers, predicted vs measured)
    properties  the paper's checklist of compressor properties, measured
    devices     GPUs this machine may lack (V100, A100, H100, H200; or described in YAML): datasheet peaks
    roofline    per-layer FLOPs and bytes counted on the meta device, priced on a device; codec costs
    collectives NCCL's ring/tree algorithms and LL/LL128/Simple protocols, two-level topologies
    ondevice    commlab predict --device: the device's profile and links, and the sources of a prediction
    child       what is measured for a viewer of the UI, in a child with limits (commlab.lab.base.sandbox)
"""

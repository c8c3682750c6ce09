"""Performance model: when does gradient compression pay (Agarwal et al., MLSys 2022)?

    costs       alpha-beta collectives per Link (ring formulas from engine.netmodel), padded
                all-gather, parameter server, token bucket of an emulated link
    iteration   one step of sync / wfbp / dear simulated: a compute thread and one link
    calibrate   Profile (JSON) from run timelines, comm spans, shaped-link and compressor measurements
    predict     iteration time of a spec, speedup over DDP, crossover bandwidth
    whatif      profile lookup and the table of ``commlab predict``
    views       what the UI page shows (speedup grid, crossovers, predicted vs measured)
    properties  the paper's checklist of compressor properties, measured
"""

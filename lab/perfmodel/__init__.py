"""Performance model: when does gradient compression pay (Agarwal et al., MLSys 2022)."""

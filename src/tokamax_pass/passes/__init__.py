"""The pass behind `tokamax_pass.optimize`: jaxpr rewriting, plans, StableHLO inspection."""

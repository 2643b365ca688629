"""Disaggregated serving (TetriInfer): prefill and decode instances and their control plane."""

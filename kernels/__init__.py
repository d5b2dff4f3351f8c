"""Hot loops of kvcdn: pure computation on tensors, no I/O and no kvcdn imports."""

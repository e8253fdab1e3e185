"""Runtime helpers every run gets: HF export rotation, the weight-sync parity probe of state-dict engines,
progress lines."""

"""The process a stage runs in: its data-parallel ranks and their launch, stop signals, a quick exit."""

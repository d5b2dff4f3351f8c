"""Edge cache nodes (byte caches near the GPUs). Never imports torch."""

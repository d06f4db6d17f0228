"""The adapters shipped with easy_context (imported on first lookup, registered by class name)."""

"""The application's framework: plug-in registries, typed user errors, command line, runtime."""

"""mojolearn Mojo kernels: one canonical float32 formula per output element (see docs/)."""

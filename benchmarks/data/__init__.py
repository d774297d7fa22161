"""The data path: JPEG decoders per core, and the loader per core against bare decode loops."""

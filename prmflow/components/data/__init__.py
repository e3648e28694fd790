"""Hand-offs on disk: atomic outputs and manifests, the Parquet schemas and their readers, step spans."""

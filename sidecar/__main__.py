from sidecar.cli import entrypoint

entrypoint()

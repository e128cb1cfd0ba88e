"""Release pipeline: the ``Releaser`` protocol, the queue that feeds it, and one module per strategy."""

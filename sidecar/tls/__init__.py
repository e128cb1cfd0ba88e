"""TLS for the sidecar's listeners and for its connections to D and P.

``names`` maps the TLS settings' names (versions, IANA cipher suites) to
OpenSSL's; ``server`` builds the serving context of a port and reloads its
certificate when the files change (a Kubernetes Secret rotated in place);
``selfsigned`` makes a certificate at start when no directory is given;
``client`` builds the outbound contexts, one per stage (D, P), trusting what
``trust`` reads from ``ssl_cert_file`` and ``ssl_cert_dir`` as Go reads them.
"""

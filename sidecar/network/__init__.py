"""Where the sidecar may connect: the allowlist every P endpoint named by a request is checked
against (``allowlist``), and the resolver that turns a P host name into checked addresses
(``resolver``)."""

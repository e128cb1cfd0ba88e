"""The images for ``linux/amd64`` and ``linux/arm64`` (``make image``, ``make image-check``).

``make image`` builds the sidecar and load-test images from the one
``Dockerfile`` for both platforms, as one multi-arch image each (a manifest
list): with podman when it is installed (``--manifest``), else with
``docker buildx`` (``IMAGE_PUSH=1`` pushes to the registry ``IMAGE_REPO``
names, the way a multi-arch image leaves a Docker builder). The vLLM plugin
image is built for this machine's platform, on the deployment's vLLM image.

Where no container registry answers, ``python:3.11-slim-bookworm`` cannot be
pulled: ``make image`` then builds a stand-in for it per platform from
Debian's packages (``mmdebstrap``: the same Debian 12 and Python 3.11, pip
allowed system-wide, the interpreter in ``/usr/local/bin``), once, and
files them under the base's name as a manifest list, so each platform's
build finds its own. The arm64 stand-in and build run under qemu-user
emulation on an x86_64 host (binfmt_misc, as ``make arm64``).

``make image-check`` checks each platform's image as a user would run it:
no torch, the numeric non-root user, ``/app/pd-sidecar --help`` (KServe's
command), a NIXL agent with the UCX backend, and ``/readyz`` answering 503
while D is away; and reports each image's size and its virtual environment's.
The image's file system is mounted and run as its user in a chroot (these
machines start no container: podman cannot set its resource limits here).
"""

"""The arm64 lane (``make arm64``, ``make arm64-proof``): the project on aarch64 Linux, under emulation.

On an x86_64 host the lane runs aarch64 code through qemu-user (Debian's
``qemu-user-static``, registered with the kernel's binfmt_misc), in a chroot
of an arm64 Debian root file system built from Debian's packages by
``mmdebstrap`` (only extracted, which takes seconds, not configured, which
takes minutes under emulation) and cached under ``/var/cache`` by its
package list. On an aarch64 host the same chroot runs natively. Inside, the
checkout installs from uv.lock as ``make`` installs it anywhere, then runs:

* ``make arm64``: the unit suite, the NIXL release integration tests (real
  agents, the P simulator), the workers' stopped-worker tests and ``make demo``;
* ``make arm64-proof``: the smallest part that proves the platform, for CI:
  the install, the shared table's tests and one release through NIXL end to
  end against the P simulator.

Emulated code runs five to ten times slower than native, unevenly: the lane
asserts no duration (``KVR_EMULATED=1``, ``tests.support.emulation``), and the times
it prints are not measurements. Nor can emulation show a weakly ordered
CPU's reorderings (qemu-user runs arm64 code with the host's order), which is
why the shared table is right by construction (``sidecar.release.shared``).

It needs root (mounts, chroot, Debian packages) and, on x86_64, binfmt_misc;
without either it stops at once with one line saying what is missing. Every
step has a time limit; the mounts live in a mount and PID namespace of their
own, so they go when a step ends, passes, fails or is killed.
"""

"""Huge pages for the service's large buffers: glibc's ``glibc.malloc.hugetlb`` tunable in a task's environment.

A step at 1e7 parameters moves 80 MB messages; glibc serves every block that
large with a fresh ``mmap`` (its threshold stops at 32 MB), so each one costs
a page fault per 4 KiB page as it is first written: at 1e7 parameters the
servers spent more time faulting than adding. With ``glibc.malloc.hugetlb=1``
(glibc >= 2.35) malloc asks for transparent huge pages for those blocks, 2 MiB
per fault. It only takes effect when the kernel's THP mode is ``madvise`` or
``always``, and it must be in the environment when the process starts, so the
launcher and the Kubernetes manifests set it for service-mode tasks; older C
libraries ignore it. Measured (`python -m tools.bench`, service cases): see
docs/benchmarks.md.

Example::

    env = with_huge_pages(os.environ)     # GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (kept if the user set it)
    subprocess.Popen(argv, env=env)
"""
from typing import Dict, Mapping

__all__ = ["TUNABLES_ENV", "HUGE_PAGES_TUNABLE", "with_huge_pages"]

TUNABLES_ENV = "GLIBC_TUNABLES"
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def with_huge_pages(env: Mapping[str, str]) -> Dict[str, str]:
    """A copy of `env` whose ``GLIBC_TUNABLES`` asks malloc for huge pages, unless it already says something
    about ``glibc.malloc.hugetlb`` (the user's choice stands)."""
    env = dict(env)
    tunables = [t for t in env.get(TUNABLES_ENV, "").split(":") if t]
    if not any(t.split("=", 1)[0] == "glibc.malloc.hugetlb" for t in tunables):
        env[TUNABLES_ENV] = ":".join(tunables + [HUGE_PAGES_TUNABLE])
    return env

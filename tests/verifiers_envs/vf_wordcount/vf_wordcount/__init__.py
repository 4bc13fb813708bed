"""vf-wordcount: count the words of a sentence with a tool, a tiny verifiers environment for loomrl's tests.

verifiers finds an environment by its id: `vf-wordcount` imports the module `vf_wordcount`, whose `__all__` exports
its Taskset (and here its Env: the protocol). Install it (`pip install -e tests/verifiers_envs/vf_wordcount`) or put
this folder on sys.path (loomrl's `env.args.paths`).
"""

from vf_wordcount.taskset import WordcountEnv, WordcountTaskset

__all__ = ["WordcountEnv", "WordcountTaskset"]

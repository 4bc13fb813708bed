"""Environments of other libraries behind loomrl's Environment API: `env.name: <adapter>:<id>` (env/api.py ADAPTERS).

- `verifiers`: an installed verifiers (0.4.0, v1 API) environment, driven turn by turn inside loomrl's agent loop
  (adapters/verifiers.py; its episodes: adapters/verifiers_episode.py).
"""

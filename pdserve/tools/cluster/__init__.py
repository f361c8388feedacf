"""The local cluster behind `pdserve up` and `pdserve.tools.launcher.Cluster`, one job a module:

- config: `ClusterConfig`, what to start, validated when built;
- plan: the child processes (`ProcessSpec`) and every flag each one gets, from a config;
- child: starting a child process that dies with the launcher and pins itself (`spawn`,
  `child_main`);
- running: `Cluster`, the children started, waited for, signalled and stopped.

Users import these names from pdserve.tools.launcher (the public path, with the CLI); see its
module docstring for the whole picture.
"""

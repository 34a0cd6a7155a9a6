"""sparta_tools: what runs beside a training job, never inside one.

    cluster.py  EmulatedCluster, ClusterConfig: nodes as Linux network namespaces behind
                tbf-shaped links, each node's ranks on their own CPUs (root, iproute2)
    profile.py  `sparta profile`: start an expert-parallel MoE block on local ranks (or on
                an emulated cluster), trace it, print the fitted cost models
    bench/      `sparta bench`: the microbenchmark suites (collectives, alltoallv, ...),
                their JSON-lines records, `compare` and `plot`

A separate top-level package so that `import sparta` (what a training script imports) holds
no launcher, no root-only network set-up and no plotting; `sparta profile` imports it only
when that subcommand runs. Imports point one way: sparta_tools uses sparta, never back.
"""

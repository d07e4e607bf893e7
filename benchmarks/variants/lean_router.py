import sys, yaml
src, dst = sys.argv[1], sys.argv[2]
c = yaml.safe_load(open(src))
app = c["applications"][0]
app["runtime_env"] = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
for d in app["deployments"]:
    if d["name"] == "Router":
        d["autoscaling_config"]["min_replicas"] = 6
yaml.safe_dump(c, open(dst, "w"), sort_keys=False)

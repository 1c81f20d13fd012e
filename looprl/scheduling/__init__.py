"""Where looprl's parts run: `single_process.py` puts engine, gateway, controller and
trainer in this process; `ray.py` runs engine replicas and trainer ranks as Ray actors."""

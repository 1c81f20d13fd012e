"""Where looprl's parts run: `local` puts engine, gateway and controller in one process."""

from splitface.sim.cli import main

main()

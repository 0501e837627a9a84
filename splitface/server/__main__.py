from splitface.server.cli import main

main()

from splitface.export.cli import main

main()

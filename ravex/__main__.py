from ravex.cli import main

main()

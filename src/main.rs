fn main() {
    eprintln!("outboxd: the daemon's command line arrives with the relay");
    std::process::exit(2);
}

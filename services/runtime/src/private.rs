//! Everything Strata writes is its user's alone: block files hold prompts' token ids, the run
//! directory holds sockets and the admin token. The process umask is tightened at start, so a
//! file or directory created by any code (sled's included) is 0600 / 0700 whatever umask the
//! user started it with, and trees written by an older version are tightened when opened.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Makes files and directories this process (and its children) create private: umask 077.
pub fn restrict_new_files() {
    // SAFETY: umask(2) cannot fail; it only replaces the process's file mode mask.
    unsafe {
        libc::umask(0o077);
    }
}

/// Makes `dir` and everything below it private (directories 0700, other entries 0600),
/// changing only what is wider. Symbolic links are not followed.
pub fn tighten_tree(dir: &Path) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let wanted = if meta.is_dir() { 0o700 } else { 0o600 };
    if meta.permissions().mode() & 0o777 & !wanted != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(wanted))?;
    }
    if meta.is_dir() {
        for entry in std::fs::read_dir(dir)? {
            tighten_tree(&entry?.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_trees_become_private_and_links_are_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("kv");
        std::fs::create_dir_all(dir.join("blocks/ab")).unwrap();
        let file = dir.join("blocks/ab/block");
        std::fs::write(&file, b"x").unwrap();
        for p in [&dir, &dir.join("blocks"), &dir.join("blocks/ab")] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"y").unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        tighten_tree(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join("blocks/ab")), 0o700);
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&outside), 0o644);
    }
}

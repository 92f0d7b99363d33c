//! The layout's placement of blocks and replicas.

use super::*;

#[test]
fn blocks_tile_the_gradient_aligned_and_replicas_come_before() {
    let l = ShardLayout::new(1000, 3, 0, 1).unwrap();
    assert_eq!(l.blocks(), &[0..320, 320..656, 656..1000]);
    assert_eq!(l.held(), vec![0, 2]);
    assert_eq!(l.holders(2), vec![2, 0]);
    assert!(l.holders(3).is_empty(), "a block past the world has no holder");
    assert_eq!(ShardLayout::new(1000, 3, 2, 2).unwrap().held(), vec![2, 1, 0]);
    // Fewer values than ranks: empty blocks, still a tiling.
    let small = ShardLayout::new(5, 4, 1, 0).unwrap();
    assert_eq!(small.blocks(), &[0..0, 0..0, 0..0, 0..5]);
    assert!(ShardLayout::new(10, 2, 0, 2).is_err());
    assert!(ShardLayout::new(10, 2, 2, 0).is_err());
    assert_eq!(ShardLayout::new(10, 1, 0, 3).unwrap().replicas(), 0);
}

#[test]
fn over_hosts_every_holder_of_a_block_is_on_another_host() {
    // Three hosts of two local ranks, two replicas: the same local rank on each host.
    for rank in 0..6 {
        let l = ShardLayout::over_hosts(6000, 6, 2, rank, 2).unwrap();
        assert_eq!(l.held()[0], rank);
        for b in 0..6 {
            let hosts: Vec<usize> = l.holders(b).iter().map(|r| r / 2).collect();
            assert_eq!(hosts.len(), 3);
            assert!(hosts.iter().all(|h| hosts.iter().filter(|x| *x == h).count() == 1), "{hosts:?}");
            assert!(l.holders(b).iter().all(|r| r % 2 == b % 2), "a replica at another local rank");
            assert_eq!(l.holders(b).contains(&rank), l.held().contains(&b));
        }
    }
    assert_eq!(ShardLayout::over_hosts(6000, 6, 2, 3, 1).unwrap().held(), vec![3, 1]);
    // Replicas need other hosts; one host holds none; ranks come in whole hosts.
    assert!(ShardLayout::over_hosts(100, 6, 2, 0, 3).is_err());
    assert_eq!(ShardLayout::over_hosts(100, 4, 4, 1, 1).unwrap().held(), vec![1]);
    assert!(ShardLayout::over_hosts(100, 5, 2, 0, 0).is_err());
    assert!(ShardLayout::over_hosts(100, 4, 0, 0, 0).is_err());
    // One rank per host is the plain layout.
    assert_eq!(ShardLayout::over_hosts(1000, 3, 1, 0, 1).unwrap(), ShardLayout::new(1000, 3, 0, 1).unwrap());
}

//! Feeds arbitrary bytes to the checkpoint / state-image decoder, which reads files from disk
//! and, later, state streamed from peers. It must return an error, never panic or hang, and a
//! state it accepts must encode back to bytes it accepts again as the same state. The same
//! bytes as a file go through the streamed check a writer reads its file back with, which
//! must accept exactly what the decoder accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_snapshot::StateImage;

fuzz_target!(|data: &[u8]| {
    let decoded = StateImage::decode(data);
    if let Ok(img) = &decoded {
        let again = StateImage::decode(&img.encode().expect("a decoded image encodes")).expect("re-decodes");
        assert_eq!(&again, img);
    }
    let path = std::env::temp_dir().join(format!("limpet-fuzz-checkpoint-{}", std::process::id()));
    std::fs::write(&path, data).expect("a temporary file");
    let checked = limpet_snapshot::verify_file(&path);
    match (&decoded, &checked) {
        (Ok(img), Ok(meta)) => assert_eq!(img.meta(), meta),
        (Err(_), Err(_)) => {}
        _ => panic!("decode {:?} but the streamed check {:?}", decoded.as_ref().map(|_| ()), checked),
    }
});

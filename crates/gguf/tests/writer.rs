//! The streaming writer: what it writes reads back through `GgufFile`
//! (metadata, shapes, types, bytes), it asks for each tensor once, in
//! order, and a failed write leaves neither the file nor its `.part`.

use gguf::writer::{write_tensors, TensorHeader};
use gguf::{quantize, GgmlType, GgufError, GgufFile, Value, ValueType};

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("macrobatch-gguf-writer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 3.0).collect()
}

#[test]
fn streamed_files_read_back() {
    let metadata = vec![
        ("general.architecture".to_string(), Value::String("llama".into())),
        ("x.list".to_string(), Value::Array(ValueType::String, vec![Value::String("a b".into())])),
        ("x.n".to_string(), Value::U32(7)),
    ];
    let types = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0];
    let tensors: Vec<TensorHeader> = types
        .iter()
        .enumerate()
        .map(|(i, &id)| TensorHeader {
            name: format!("t{i}"),
            ne: vec![64, 3 + i as u64],
            ty: GgmlType::from_id(id).unwrap(),
        })
        .collect();
    let data: Vec<Vec<f32>> =
        tensors.iter().enumerate().map(|(i, t)| values(64 * t.ne[1] as usize, i as f32)).collect();
    let path = tmp("streamed.gguf");
    let mut asked = Vec::new();
    write_tensors::<_, GgufError, _>(&path, &metadata, &tensors, |i| {
        asked.push(i);
        quantize(tensors[i].ty, &data[i])
    })
    .unwrap();
    assert_eq!(asked, [0, 1, 2, 3, 4]);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata(), &metadata[..]);
    for (t, x) in tensors.iter().zip(&data) {
        let info = f.tensor(&t.name).unwrap();
        assert_eq!((info.ne.clone(), info.type_id), (t.ne.clone(), t.ty.id));
        assert_eq!(f.tensor_bytes(&t.name).unwrap().1, &quantize(t.ty, x).unwrap()[..], "{}", t.name);
    }
    assert!(!path.with_extension("gguf.part").exists());
}

#[test]
fn failed_writes_leave_nothing() {
    let path = tmp("failed.gguf");
    let t = vec![TensorHeader { name: "w".into(), ne: vec![32, 2], ty: GgmlType::from_id(GgmlType::Q8_0).unwrap() }];
    let meta: [(&str, Value); 0] = [];
    // The closure's own error is passed through.
    let e =
        write_tensors::<_, GgufError, _>(&path, &meta, &t, |_| Err(GgufError::Encode("no data".into()))).unwrap_err();
    assert!(e.to_string().contains("no data"), "{e}");
    // A wrong byte count is caught.
    let e = write_tensors::<_, GgufError, _>(&path, &meta, &t, |_| Ok(vec![0; 10])).unwrap_err();
    assert!(e.to_string().contains("`w`") && e.to_string().contains("68"), "{e}");
    // A shape that is not whole blocks is refused before anything is asked for.
    let odd = vec![TensorHeader { name: "odd".into(), ne: vec![33], ..t[0].clone() }];
    let e = write_tensors::<_, GgufError, _>(&path, &meta, &odd, |_| unreachable!()).unwrap_err();
    assert!(e.to_string().contains("odd"), "{e}");
    // A metadata key given twice (an architecture's and a tokenizer's, say).
    let twice = [("general.name", Value::U32(1)), ("general.name", Value::U32(2))];
    let e = write_tensors::<_, GgufError, _>(&path, &twice, &t, |_| unreachable!()).unwrap_err();
    assert!(e.to_string().contains("`general.name` is given twice"), "{e}");
    assert!(!path.exists() && !path.with_extension("gguf.part").exists());
}

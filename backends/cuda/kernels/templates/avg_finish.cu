    {
      const int he = min(hs + $KH, H + $PH), we = min(ws + $KW, W + $PW);
      const int pool = (he - hs) * (we - ws);
      const int cnt = $count_include_pad ? pool : (min(he, H) - max(hs, 0)) * (min(we, W) - max(ws, 0));
      acc = acc / (float)cnt;
    }
